"""Maintainers' tools: make_megatron_core_manifest.py writes the API manifests in tests/data."""
