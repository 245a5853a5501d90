"""``fdx chat`` and ``fdx complete``: talk to a running OpenAI-compatible
server (``fdx serve``, or any other) from the terminal.

Interactive when stdin is a terminal: a prompt, the reply streamed as it
comes; ``fdx chat`` keeps the conversation (``/clear`` forgets it, ``/exit``
or Ctrl-D ends).  With a piped stdin (``echo hi | fdx chat``) or ``-q
TEXT``, one request, the reply streamed to stdout, then exit.  A server
that cannot be reached, or that answers with an error, is one line on
stderr and exit code 1.  Only ``httpx`` (no ``openai`` package needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterator, Sequence

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    """A one-line failure (exit code 1)."""


def build_parser(verb: str) -> argparse.ArgumentParser:
    what = "chat with" if verb == "chat" else "complete prompts on"
    p = argparse.ArgumentParser(prog=f"fdx {verb}", description=f"{what} a running OpenAI-compatible server")
    p.add_argument("--url", default=os.environ.get("FDX_URL", DEFAULT_URL),
                   help=f"the server's base URL (default {DEFAULT_URL}, or $FDX_URL)")
    p.add_argument("--model", help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer key (default $FDX_API_KEY, then $OPENAI_API_KEY)")
    p.add_argument("-q", "--quick", metavar="TEXT", help="send TEXT once, print the reply, exit")
    p.add_argument("--max-tokens", type=int, help="most tokens per reply")
    p.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    if verb == "chat":
        p.add_argument("--system", help="a system message to start the conversation")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a reply (default 600)")
    return p


class Client:
    """The few calls the verbs make, over one ``httpx`` client."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        import httpx

        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=httpx.Timeout(timeout, connect=5.0))

    def _fail(self, exc: Exception) -> ClientError:
        import httpx

        if isinstance(exc, httpx.ConnectError):
            return ClientError(f"cannot reach a server at {self.base} (is `fdx serve` running? use --url)")
        if isinstance(exc, httpx.TimeoutException):
            return ClientError(f"no reply from {self.base} in time")
        if isinstance(exc, httpx.HTTPError):
            return ClientError(f"request to {self.base} failed: {exc}")
        return ClientError(str(exc))

    @staticmethod
    def _error_text(status: int, raw: bytes) -> str:
        try:
            err = json.loads(raw)["error"]
            return f"server answered {status}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            return f"server answered {status}: {raw[:200].decode(errors='replace')}"

    def first_model(self) -> str:
        try:
            r = self.http.get("/v1/models")
        except Exception as exc:  # noqa: BLE001 - one line, whatever failed
            raise self._fail(exc) from None
        if r.status_code != 200:
            raise ClientError(self._error_text(r.status_code, r.content))
        data = r.json().get("data") or []
        if not data:
            raise ClientError(f"{self.base} serves no model")
        return str(data[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON chunks of a streaming request."""
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    raise ClientError(self._error_text(r.status_code, r.read()))
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ClientError(f"the server failed mid-reply: {chunk['error'].get('message')}")
                    yield chunk
        except ClientError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from None


def _options(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"model": args.model}
    if args.max_tokens is not None:
        out["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        out["temperature"] = args.temperature
    return out


def _say(client: Client, path: str, body: dict[str, Any], out: Any) -> str:
    """Stream one reply to ``out``; returns its text."""
    parts: list[str] = []
    for chunk in client.stream(path, body):
        for c in chunk.get("choices") or []:
            piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
            if piece:
                parts.append(piece)
                out.write(piece)
                out.flush()
    out.write("\n")
    out.flush()
    return "".join(parts)


def _lines(prompt: str) -> Iterator[str]:
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print()
            return


def chat(args: argparse.Namespace, client: Client) -> int:
    base = _options(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    one = args.quick if args.quick is not None else (None if sys.stdin.isatty() else sys.stdin.read())
    if one is not None:
        if not one.strip():
            raise ClientError("nothing to send (empty input)")
        _say(client, "/v1/chat/completions", {**base, "messages": [*history, {"role": "user", "content": one}]},
             sys.stdout)
        return 0
    print(f"fdx chat with {base['model']} at {client.base}  (/clear forgets, /exit or Ctrl-D ends)")
    for line in _lines("> "):
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/clear":
            history = history[:1] if args.system else []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = _say(client, "/v1/chat/completions", {**base, "messages": history}, sys.stdout)
        except ClientError as exc:
            history.pop()
            print(f"fdx: error: {exc}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})
    return 0


def complete(args: argparse.Namespace, client: Client) -> int:
    base = _options(args)
    one = args.quick if args.quick is not None else (None if sys.stdin.isatty() else sys.stdin.read())
    if one is not None:
        if not one:
            raise ClientError("nothing to send (empty input)")
        _say(client, "/v1/completions", {**base, "prompt": one}, sys.stdout)
        return 0
    print(f"fdx complete with {base['model']} at {client.base}  (each line is a prompt; /exit or Ctrl-D ends)")
    for line in _lines("> "):
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        try:
            _say(client, "/v1/completions", {**base, "prompt": line}, sys.stdout)
        except ClientError as exc:
            print(f"\nfdx: error: {exc}", file=sys.stderr)
    return 0


def main(verb: str, argv: Sequence[str]) -> int:
    args = build_parser(verb).parse_args(list(argv))
    key = args.api_key or os.environ.get("FDX_API_KEY") or os.environ.get("OPENAI_API_KEY")
    try:
        client = Client(args.url, key, args.timeout)
        if not args.model:
            args.model = client.first_model()
        return chat(args, client) if verb == "chat" else complete(args, client)
    except ClientError as exc:
        print(f"fdx: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
