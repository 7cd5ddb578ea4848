"""Example Celery configuration for a celery_ext app (see celeryconfig.py)."""
