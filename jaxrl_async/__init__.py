"""jaxrl_async: JAX-native, fully asynchronous RL post-training for LLM reasoning."""

import os as _os

# transformers prints "PyTorch was not found. Models won't be available ..." on import when torch is
# absent (our runtime install: we only use its tokenizers and configs). That line and the other
# "advisory" warnings of transformers do not concern our users; set the variable to "" to see them.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
