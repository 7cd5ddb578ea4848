"""Benchmarks: celery-ext vs stock Celery-on-Redis on one server (``python -m bench``)."""
