"""Chat with a real model from the command line: `python -m phase7_optim "your question"`.

With no --model, the embedded SmolLM2-135M-Instruct answers (converted from its GGUF on first use,
then cached); --model takes a local Hugging Face directory or a hub id.
"""

import argparse
import time

from .engine import LLM
from .sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m phase7_optim", description=__doc__)
    parser.add_argument("prompt", nargs="*", default=["What is the capital of France?"])
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    try:  # before the slow load: a bad flag is a usage error, not a traceback
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    llm = LLM(args.model)
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": " ".join(args.prompt)}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    completion = out[0].outputs[0]
    print(completion.text)
    num_tokens, reason = len(completion.token_ids), completion.finish_reason
    print(f"[{num_tokens} tokens in {elapsed:.2f} s, finish reason: {reason}]")


if __name__ == "__main__":
    main()
