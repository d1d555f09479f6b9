"""The web dashboard's files (static/), served by the coordinator at /ui/ (coordinator/api/routes/ui.py)."""
