"""Best-of-N the way llama-cpp-python users must do it: one sequence, so each
candidate restores the prompt's saved state (``save_state`` /
``load_state``) and generates sequentially. Run by ``bench/branching.py``
inside a separate virtual environment that has llama-cpp-python; prints one
JSON line.

    python llama_cpp_python_best_of_n.py MODEL TOKENS.json N STEPS THREADS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from llama_cpp import Llama  # type: ignore[import-not-found]


def main() -> None:
    model, tokens_file, n, steps, threads = sys.argv[1:6]
    prompt = json.loads(Path(tokens_file).read_text())
    llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_threads=int(threads), verbose=False)
    llm.eval(prompt)
    state = llm.save_state()
    started = time.perf_counter()
    for _ in range(int(n)):
        llm.load_state(state)
        for _ in range(int(steps)):
            token = llm.sample(temp=0.0)
            llm.eval([token])
    seconds = time.perf_counter() - started
    print(json.dumps({"branches": int(n), "steps": int(steps), "seconds": seconds}))


if __name__ == "__main__":
    main()
