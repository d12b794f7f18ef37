"""The relay's HTTP API: ``POST /api/inject/v1`` (KumoMTA's injection body), served on the relay's trio loop."""
