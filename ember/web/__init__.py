"""The HTTP pieces the API and the replica both serve with, below both: RFC 9457 problems
(``problems``), request ids and size limits (``middleware``), the priority lane
(``lane``) and raw request bodies (``bodies``). It imports neither ``ember.api`` nor
``ember.engine``."""
