"""Prefect deployments of the refit and publish flows (``serve.py`` and ``prefect.yaml``)."""
