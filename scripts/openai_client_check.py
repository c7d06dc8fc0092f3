"""Drive an OpenAI-compatible server with the official `openai` Python
package: models, chat and completions, streaming and not, usage in the
stream, logprobs, and the errors the client maps to exceptions.

    .venv-client/bin/python scripts/openai_client_check.py \
        --base-url http://127.0.0.1:8000/v1 --model SmolLM2-135M-Instruct

Run by p06_server's tests (tests/openai_client.rs) against a live server.
Exits non-zero on the first failed check.
"""

import argparse
import sys

import openai
from openai import OpenAI


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=120)
    print(f"openai {openai.__version__} against {a.base_url}")

    ids = [m.id for m in client.models.list().data]
    check(a.model in ids, f"models.list has {a.model} ({ids})")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=a.model, messages=messages, max_tokens=16, temperature=0
    )
    text = chat.choices[0].message.content
    check(chat.object == "chat.completion" and text, f"chat non-streaming: {text!r}")
    check(chat.choices[0].finish_reason in ("stop", "length"), "chat finish_reason")
    u = chat.usage
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens > 0, f"chat usage {u}")

    stream = client.chat.completions.create(
        model=a.model, messages=messages, max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    check("".join(parts) == text, "chat streaming text equals the non-streamed text (greedy)")
    check(finish == chat.choices[0].finish_reason, f"chat streaming finish_reason {finish}")
    check(usage is not None and usage.completion_tokens == u.completion_tokens, f"usage in the stream {usage}")

    lp = client.chat.completions.create(
        model=a.model, messages=messages, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = lp.choices[0].logprobs.content
    check(len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content),
          "chat logprobs with top_logprobs=2")

    comp = client.completions.create(
        model=a.model, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    ctext = comp.choices[0].text
    check(comp.object == "text_completion" and ctext, f"completions non-streaming: {ctext!r}")
    sparts = [c.choices[0].text for c in client.completions.create(
        model=a.model, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True,
    ) if c.choices]
    check("".join(sparts) == ctext, "completions streaming text equals the non-streamed text")

    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        check(False, "unknown model raises NotFoundError")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"unknown model -> 404 ({e.message})")
    try:
        client.chat.completions.create(model=a.model, messages=messages, max_tokens=10**6)
        check(False, "over-long request raises BadRequestError")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "context" in e.message, f"context overflow -> 400 ({e.message})")
    try:
        client.chat.completions.create(model=a.model, messages=messages, temperature=7)
        check(False, "bad temperature raises BadRequestError")
    except openai.BadRequestError as e:
        check(e.body.get("param") == "temperature", f"temperature out of range -> 400 naming it")
    print("all checks passed")


if __name__ == "__main__":
    main()
