"""The paged cache: what each target layer caches (``layout``), the pools and block allocator (``pools``), the
target's view of them through transformers' Cache seam (``hf_cache``) and recurrent-state layers (``recurrent``)."""
