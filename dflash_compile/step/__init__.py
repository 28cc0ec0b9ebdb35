"""The speculative step, the only thing compiled: verify, accept, inject, propose (``step``), and the acceptance
and sampling rules it uses (``rejection``)."""
