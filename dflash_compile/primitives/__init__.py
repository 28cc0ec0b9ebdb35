"""The rules several parts of the package share, each written once: slot arithmetic over pages (``slots``), which
keys a query sees (``masks``) and the drafter's context K/V projection (``kv_projection``). Torch only."""
