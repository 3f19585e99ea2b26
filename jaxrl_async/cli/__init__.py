"""The command-line tools, one module each: ``main`` (the RL run), ``generate``, ``evaluate``, ``score``,
``export``, ``plan``; ``common`` holds what they share (the one-line error style, parsers, path checks),
``jsonl`` the row reader of ``generate`` / ``score`` and ``compile_cache`` the persistent compilation cache
they turn on. Run them as ``python -m jaxrl_async.<tool>`` (the top-level modules of those names are the
entry points and hold nothing else). No library module imports a CLI module.
"""
