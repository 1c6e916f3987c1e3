"""The ``ember`` command.

Server side: ``ember up`` (everything on one machine), ``ember serve`` (the API only),
``ember worker``, ``ember beat``, ``ember engine``. Client side (talks to the API at
``EMBER_URL`` with ``EMBER_API_KEY``): ``ember models``, ``ember deployments``, ``ember
keys``, ``ember tenants``, ``ember jobs``, ``ember batch``, ``ember cache``.

One way to add a command: a module of this package defines ``app`` — ``group(help)``
for a command group, ``commands()`` for top-level commands — and is named in
``COMMANDS`` below with the names it adds. Its top imports stay light
(``ember.cli.common`` says which): ``ember --help`` imports every module.

**Built on demand.** typer turns every command function into a click command (its
signature, type hints, options) before it parses a word; for 55 commands that cost more
than the imports of their modules. Here ``ember`` knows its subcommands' names from
``COMMANDS`` alone (``LazyCommands``): a module is imported when one of its names is
looked up, and a command is built when it is. ``ember --help`` builds the top-level
commands and the groups, none of the groups' commands; ``ember models ls`` imports one
module and builds one command. What is built is what typer's own tree holds, piece by
piece: the same help, options, errors, completion.

**Coerced on demand.** typer (0.2x) coerces parameter values with pydantic; ``ValueFirst``
keeps it from importing pydantic for a command that has no value to coerce.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

import typer
import typer.core
import typer.main
import typer.models
from typer._coercion import RuntimeParam

if TYPE_CHECKING:
    from typer._click import Command, Context

COMMANDS: tuple[tuple[str, str | tuple[str, ...]], ...] = (
    ("server", ("serve", "up")),
    ("beat", ("beat",)),
    ("engine", ("engine", "calibrate")),
    ("worker", ("worker",)),
    ("simulate", ("simulate",)),
    ("tenants", "tenants"),
    ("keys", "keys"),
    ("models", "models"),
    ("deployments", "deployments"),
    ("batch", "batch"),
    ("jobs", "jobs"),
    ("cache", "cache"),
)
"""``(module, group name)``, in the order ``ember --help`` lists them; a tuple of names
instead of a group name merges the module's commands (those names, in that order) into
``ember`` itself."""


class LazyCommands(MutableMapping[str, "Command"]):
    """A group's subcommands by name, each built the first time it is read.

    A slot holds a built command, the ``CommandInfo`` typer registered for it (built on
    reading), or, in ``ember``'s own mapping, the name of the ``ember.cli`` module that
    defines it (imported on reading, which fills the slots of all its names)."""

    def __init__(self, slots: Mapping[str, Command | typer.models.CommandInfo | str]) -> None:
        self.slots = dict(slots)

    def __getitem__(self, name: str) -> Command:
        slot = self.slots[name]
        if isinstance(slot, str):
            self.slots.update(_load(slot))
            slot = self.slots[name]
            if isinstance(slot, str):
                raise RuntimeError(f"COMMANDS names {name!r}, ember.cli.{slot} defines no such")
        if isinstance(slot, typer.models.CommandInfo):
            slot = self.slots[name] = typer.main.get_command_from_info(
                slot,
                pretty_exceptions_short=app.pretty_exceptions_short,
                rich_markup_mode=app.rich_markup_mode,
            )
        return slot

    def __setitem__(self, name: str, command: Command) -> None:
        self.slots[name] = command

    def __delitem__(self, name: str) -> None:
        del self.slots[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)


def _load(module: str) -> dict[str, Command | typer.models.CommandInfo]:
    """The slots of ``ember.cli.<module>``: its commands, unbuilt, or (a group module) its
    group, built as ``app.add_typer(module.app, name=...)`` would build it but with
    unbuilt commands."""
    name = dict(COMMANDS)[module]
    sub = import_module(f"ember.cli.{module}").app
    commands: dict[str, Command | typer.models.CommandInfo] = {}
    for info in sub.registered_commands:
        assert info.callback, "A command must have a callback function"  # as typer asserts
        commands[info.name or typer.main.get_command_name(info.callback.__name__)] = info
    if not isinstance(name, str):
        return commands
    # typer builds a group's commands as it builds the group: give it a copy of the app
    # with none registered, then the group its commands, unbuilt.
    bare = copy.copy(sub)
    bare.registered_commands = []
    group = typer.main.get_group_from_info(
        typer.models.TyperInfo(bare, name=name),
        pretty_exceptions_short=app.pretty_exceptions_short,
        suggest_commands=app.suggest_commands,
        rich_markup_mode=app.rich_markup_mode,
    )
    group.commands = LazyCommands(commands)
    return {name: group}


_typers_runtime_param = typer.core._TyperParameter.get_runtime_param


@dataclass(frozen=True)
class ValueFirst(RuntimeParam):
    """A parameter's coercion that builds typer's own only for a value it has to coerce.

    typer coerces a parameter's value through a pydantic ``TypeAdapter`` it builds on first
    use, and builds it before looking at the value, also for the value it then passes
    through untouched: ``None``, an option not given. Every command has such options
    (``--help``; ``--install-completion`` and ``--show-completion`` on ``ember``), so every
    command imported pydantic, ~0.1 s, even one with nothing to coerce (``ember models
    ls``). ``RuntimeParam.coerce``, typer's, still decides what needs coercing; what does
    goes to typer's own coercion, built (and kept on the parameter) then."""

    def _coerce_value(self, value: Any, param: typer.core._TyperParameter, ctx: Context) -> Any:
        return _typers_runtime_param(param)._coerce_value(value, param=param, ctx=ctx)


def _value_first(param: typer.core._TyperParameter) -> RuntimeParam:
    descriptor = param.type_descriptor
    return ValueFirst(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation)


typer.core._TyperParameter.get_runtime_param = _value_first  # type: ignore[method-assign, assignment]


class EmberGroup(typer.core.TyperGroup):
    """The root group: its subcommands are ``LazyCommands`` named by ``COMMANDS``."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        slots: dict[str, Command | typer.models.CommandInfo | str] = {}
        for module, names in COMMANDS:
            for name in (names,) if isinstance(names, str) else names:
                slots[name] = module
        self.commands = LazyCommands(slots)


def _root() -> None:
    """``ember`` itself does nothing before its subcommand. typer builds a group of an app
    with a callback or registered subcommands, and ``ember`` registers none with typer
    (``EmberGroup`` holds them): hence this callback."""


app = typer.Typer(
    cls=EmberGroup,
    callback=_root,
    help="Ember: register, deploy and call model versions — warm pools, fast cold starts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
