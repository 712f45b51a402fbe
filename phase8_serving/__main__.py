"""`python -m phase8_serving ...` is the `mini-vllm` command: serve, generate, chat (see cli.py).

`python -m phase8_serving chat` talks to the embedded SmolLM2 offline; `python -m phase8_serving
serve` starts the OpenAI-compatible server on http://127.0.0.1:8000.
"""

from .cli import main

if __name__ == "__main__":
    main()
