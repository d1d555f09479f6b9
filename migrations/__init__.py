"""Alembic environment and revisions: the only writer of the registry schema."""
