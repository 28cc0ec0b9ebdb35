"""An OpenAI-compatible HTTP server over a ``DFlashSpecWrapper`` (``dflash-serve``; docs/serving.md).

- ``cli``: the command line (``main``), loading the pair, binding and running uvicorn.
- ``app``: the Starlette routes (``create_app(engine)``).
- ``engine``: requests onto the wrapper's scheduler and tokens back onto the event loop (``Engine``, ``Generation``).
- ``protocol``: OpenAI's request fields, error body and response objects.
- ``metrics``: the Prometheus metrics.

Needs the ``serve`` extra (``pip install 'dflash_compile[serve]'``); nothing here is imported by the rest of the
package.
"""
