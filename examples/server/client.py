"""The official openai client against `lloyal serve` (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import openai

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    """`lloyal serve` on a free port, with the default model."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lloyal", "serve", "--port", str(port), "--n-seq-max", "8"],
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


async def main(base_url: str, max_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    question = [{"role": "user", "content": "Name a river in Europe."}]

    print("streamed:", end=" ", flush=True)
    stream = await client.chat.completions.create(
        model="m", messages=question, max_tokens=max_tokens, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # Eight concurrent requests: their tokens share decodes on the server.
    t0 = time.perf_counter()
    replies = await asyncio.gather(
        *[
            client.chat.completions.create(
                model="m", messages=question, max_tokens=max_tokens, seed=i
            )
            for i in range(8)
        ]
    )
    tokens = sum(r.usage.completion_tokens for r in replies if r.usage)
    print(f"8 concurrent requests: {tokens} tokens in {time.perf_counter() - t0:.2f} s")

    both = await client.chat.completions.create(
        model="m", messages=question, max_tokens=max_tokens, n=2, temperature=1.0
    )
    for choice in both.choices:
        print(f"choice {choice.index}: {choice.message.content!r}")

    call = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    for tc in call.choices[0].message.tool_calls or []:
        print(f"tool call: {tc.function.name}({json.dumps(json.loads(tc.function.arguments))})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server()
    try:
        asyncio.run(main(url, args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
