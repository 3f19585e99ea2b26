"""`python -m jaxrl_async.serve`: an OpenAI-compatible HTTP server on the continuous-batching generator (issue 25).

``protocol`` (the wire format: request checks, tool-call parsing, response pieces; standard library only),
``backend`` (prompts, admission, the bridge from the generator's threads to the event loop, per-request records),
``app`` (the FastAPI routes). The command line is ``cli/serve.py``; FastAPI and uvicorn are the ``serve`` extra.
"""
