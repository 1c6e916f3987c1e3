"""Whether instances fit a version's ``input_schema``: the rule the engines apply, checked
where the work is accepted (a job at submit, a batch row when its shard is read), so bad
input is refused early instead of failing minutes later in a worker.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ember.errors import InvalidInput

DTYPES = ("float32", "float16", "float64", "int64", "int32")


def check_instances(instances: list[Any], schema: dict[str, Any] | None) -> None:
    """Reject instances that cannot fit the version's ``input_schema`` (the same rule the
    engines apply), so bad input fails at submit, not minutes later in a worker."""
    if not schema:
        return
    if "shape" in schema:
        dtype = schema.get("dtype", "float32")
        shape = tuple(schema["shape"])
        for i, instance in enumerate(instances):
            try:
                array = np.asarray(instance, dtype=dtype if dtype in DTYPES else "float32")
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidInput(
                    f"instances[{i}] is not a numeric array: {exc}", index=i
                ) from exc
            if array.shape != shape:
                raise InvalidInput(
                    f"instances[{i}] has shape {list(array.shape)}, expected {list(shape)}",
                    index=i,
                )
    elif schema.get("type") == "string":
        for i, instance in enumerate(instances):
            if not isinstance(instance, str):
                raise InvalidInput(f"instances[{i}] must be a string", index=i)
