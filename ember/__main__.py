"""``python -m ember`` runs the ``ember`` command (handy under profilers and debuggers)."""

from ember.cli import app

app()
