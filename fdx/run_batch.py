"""``fdx run-batch -i requests.jsonl -o results.jsonl``: an OpenAI Batch file
run offline through :class:`fdx.LLM`, with a progress bar.

Each input line is ``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {...}}``; each output
line, in input order, is ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`` (OpenAI's shape).  The bodies are read
by the server's own request models and range checks
(:mod:`fdx.server.protocol`), so a field the server refuses is refused
here too, with the same message.  A line that fails -- not JSON, an
unknown url, a bad body (``status_code`` 400 and the error envelope), a
request that fails in the engine -- gets an error record; the others run
as usual.  Fields the batch runner does not implement (streaming,
structured outputs, tools, ``logit_bias``) are refused by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any, Sequence

import attrs

from fdx.core.errors import FdxError, RequestError

#: body fields the server takes that the batch runner refuses (they need the API process)
BATCH_REFUSED = ("stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                 "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "logit_bias",
                 "kv_transfer_params", "suffix")
URLS = ("/v1/chat/completions", "/v1/completions")


@attrs.define
class Job:
    """One input line: its prompts (token ids) and params, or why it failed."""

    line: int
    custom_id: Any = None
    url: str = ""
    model: str = ""
    prompts: list[list[int]] = attrs.field(factory=list)
    params: Any = None
    echo: list[str] | None = None  # completions echo: each prompt's text; chat echo: the continued message
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    results: list[Any] = attrs.field(factory=list)
    status: int = 200
    error: dict[str, Any] | None = None  # a record-level error (the line itself is unusable)
    body: dict[str, Any] | None = None


def _envelope(exc: RequestError) -> dict[str, Any]:
    from fdx.server.protocol import error_body

    return error_body(str(exc), exc.code, exc.param)


def parse_job(i: int, line: str, llm: Any) -> Job:
    """One line -> a :class:`Job` ready to run, or carrying its error."""
    job = Job(i)
    try:
        rec = json.loads(line)
    except ValueError as exc:
        job.error = {"code": "invalid_json", "message": f"line {i + 1} is not JSON: {exc}"}
        return job
    if not isinstance(rec, dict) or not isinstance(rec.get("body"), dict):
        job.error = {"code": "invalid_request", "message": f"line {i + 1} needs an object with a 'body' object"}
        return job
    job.custom_id = rec.get("custom_id")
    job.url = str(rec.get("url", ""))
    if job.url not in URLS or rec.get("method", "POST") != "POST":
        job.error = {"code": "invalid_url", "message": f"line {i + 1}: url must be POST {' or '.join(URLS)}, "
                                                       f"got {rec.get('method', 'POST')} {job.url!r}"}
        return job
    try:
        _prepare(job, rec["body"], llm)
    except RequestError as exc:
        job.status, job.body = exc.code, _envelope(exc)
    return job


def _prepare(job: Job, body: dict[str, Any], llm: Any) -> None:
    from fdx.chat_template import chat_options, echo_text, render_chat
    from fdx.request_params import sampling_params
    from fdx.server.protocol import ChatCompletionRequest, CompletionRequest, chat_messages, parse_body

    for name in BATCH_REFUSED:
        if body.get(name) not in (None, False):
            raise RequestError(f"'{name}' is not supported by fdx run-batch (use fdx serve)", 400, param=name)
    cfg, tok = llm.config, llm.tokenizer
    mml = llm.engine.max_model_len
    raw = json.dumps(body).encode()
    if job.url == "/v1/chat/completions":
        req = parse_body(raw, ChatCompletionRequest)
        add_gen, cont, template_vars = chat_options(req)
        messages = chat_messages(req)
        if req.echo:
            job.echo = [echo_text(req, messages)]
        try:
            text = render_chat(tok, messages, add_gen, cont, template_vars)
        except ValueError as exc:
            raise RequestError(f"cannot apply the chat template: {exc}", 400, param="messages") from None
        job.prompts = [tok.encode(text, add_special_tokens=False)]
        explicit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rest = max(1, mml - len(job.prompts[0]))  # unset: the rest of the context, capped by the model's default
        max_tokens = explicit if explicit is not None else min(rest, llm.defaults.max_tokens or rest)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("'top_logprobs' requires 'logprobs' to be true", 400, param="top_logprobs")
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
    else:
        req = parse_body(raw, CompletionRequest)
        p = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise RequestError("'prompt' must not be empty", 400, param="prompt")
        job.prompts = [tok.encode(x, add_special_tokens=True) if isinstance(x, str) else list(x) for x in items]
        if req.echo:
            job.echo = [x if isinstance(x, str) else tok.decode(x, skip_special_tokens=False) for x in items]
        max_tokens = req.max_tokens if req.max_tokens is not None else min(16, llm.defaults.max_tokens or 16)
        num_lp = req.logprobs
    job.model = req.model or cfg.model_name
    if req.model and req.model not in (cfg.model_name, cfg.model):
        raise RequestError(f"The model '{req.model}' does not exist (this run serves '{cfg.model_name}')", 404,
                           param="model")
    job.params = sampling_params(req, max_tokens=max_tokens, num_logprobs=num_lp, max_logprobs=cfg.max_logprobs,
                                 vocab_size=tok.vocab_size, defaults=llm.defaults)
    job.return_token_ids = bool(req.return_token_ids)
    job.tokens_as_ids = bool(req.return_tokens_as_token_ids)
    for ids in job.prompts:
        if not ids:
            raise RequestError("the prompt is empty", 400, param="prompt")
        if len(ids) + max_tokens > mml:
            raise RequestError(f"This model's maximum context length is {mml} tokens. However, you requested "
                               f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                               "completion).", 400, param="max_tokens")


def run(llm: Any, jobs: Sequence[Job], progress: Any = None, group: int = 32) -> None:
    """Run the ready jobs in groups (continuous batching inside a group);
    a group that fails is re-run job by job, so only the failing job gets
    an error."""
    ready = [j for j in jobs if j.error is None and j.body is None]
    for k in range(0, len(ready), group):
        part = ready[k : k + group]
        try:
            _generate(llm, part)
        except FdxError:
            for j in part:
                try:
                    _generate(llm, [j])
                except FdxError as exc:
                    code = getattr(exc, "code", 500) or 500
                    j.status, j.body = code, _envelope(RequestError(str(exc), code))
        if progress is not None:
            progress.update(len(part))


def _generate(llm: Any, jobs: Sequence[Job]) -> None:
    prompts = [ids for j in jobs for ids in j.prompts]
    params = [j.params for j in jobs for _ in j.prompts]
    out = llm.generate(prompts, params)
    k = 0
    for j in jobs:
        j.results, k = out[k : k + len(j.prompts)], k + len(j.prompts)


def _logprobs(llm: Any, job: Job, res: Any, comp: Any) -> Any:
    if job.params.logprobs is None:
        return None
    text = (lambda t: f"token_id:{t}") if job.tokens_as_ids else llm.processor.token_text
    k = job.params.logprobs
    lps = list(comp.logprobs or [])
    if job.url == "/v1/chat/completions":
        return {"content": [{"token": (t := text(lp.token_id)), "logprob": lp.logprob, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": (a := text(tid)), "logprob": v, "bytes": list(a.encode())}
                                              for tid, v in lp.top[:k]]} for lp in lps]}
    tokens, values, tops, offsets, off = [], [], [], [], 0
    if job.echo is not None:
        plps = res.prompt_logprobs or [None] * len(res.prompt_token_ids)
        for tid, lp in zip(res.prompt_token_ids, plps):
            t = text(tid)
            tokens.append(t)
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {**{text(a): v for a, v in lp.top[:k]}, t: lp.logprob})
            offsets.append(off)
            off += len(t)
    for lp in lps:
        t = text(lp.token_id)
        tokens.append(t)
        values.append(lp.logprob)
        tops.append({**{text(a): v for a, v in lp.top[:k]}, t: lp.logprob})
        offsets.append(off)
        off += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _prompt_logprobs(llm: Any, job: Job, res: Any) -> Any:
    if job.params.prompt_logprobs is None or res.prompt_logprobs is None:
        return None
    text = llm.processor.token_text
    out: list[Any] = [None]
    for lp in res.prompt_logprobs[1:]:
        d = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(lp.token_id)}}
        for rank, (tid, v) in enumerate(lp.top[: job.params.prompt_logprobs], 1):
            d.setdefault(str(tid), {"logprob": v, "rank": rank, "decoded_token": text(tid)})
        out.append(d)
    return out


def response_body(llm: Any, job: Job) -> dict[str, Any]:
    """The endpoint's JSON body for a job that ran."""
    chat = job.url == "/v1/chat/completions"
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = cached = 0
    for p_idx, res in enumerate(job.results):
        prompt_tokens += len(res.prompt_token_ids)
        cached += res.num_cached_tokens
        for comp in res.outputs:
            completion_tokens += len(comp.token_ids)
            c: dict[str, Any] = {"index": p_idx * job.params.n + comp.index,
                                 "logprobs": _logprobs(llm, job, res, comp), "finish_reason": comp.finish_reason}
            if chat:
                c["message"] = {"role": "assistant", "content": (job.echo[0] if job.echo else "") + comp.text}
            else:
                c["text"] = (job.echo[p_idx] if job.echo is not None else "") + comp.text
                if job.params.prompt_logprobs is not None:
                    c["prompt_logprobs"] = _prompt_logprobs(llm, job, res)
                if job.return_token_ids:
                    c["prompt_token_ids"] = list(res.prompt_token_ids)
            if job.return_token_ids:
                c["token_ids"] = list(comp.token_ids)
            choices.append(c)
    body: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": "chat.completion" if chat
        else "text_completion", "created": int(time.time()), "model": job.model, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}},
        "system_fingerprint": None,
    }
    if chat and job.return_token_ids:
        body["prompt_token_ids"] = list(job.results[0].prompt_token_ids)
    if chat and job.params.prompt_logprobs is not None:
        body["prompt_logprobs"] = _prompt_logprobs(llm, job, job.results[0])
    return body


def record(llm: Any, job: Job) -> dict[str, Any]:
    """The output line of one job (OpenAI Batch output shape)."""
    rid = f"batch_req_{uuid.uuid4().hex}"
    if job.error is not None:
        return {"id": rid, "custom_id": job.custom_id, "response": None, "error": job.error}
    body = job.body if job.body is not None else response_body(llm, job)
    return {"id": rid, "custom_id": job.custom_id,
            "response": {"status_code": job.status, "request_id": rid, "body": body}, "error": None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fdx run-batch", description="run an OpenAI Batch file offline through fdx.LLM")
    p.add_argument("-i", "--input-file", "--input", dest="input", required=True,
                   help="the requests, one JSON object a line ('-': stdin)")
    p.add_argument("-o", "--output-file", "--output", dest="output", required=True,
                   help="where the results go, one a line in input order ('-': stdout)")
    p.add_argument("--model", help="'smollm2' (default), a .gguf file or a Hugging Face folder")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output, in tokens")
    p.add_argument("--max-num-seqs", type=int, help="sequences per step (default 64)")
    p.add_argument("--device", help="device plugin (default cpu)")
    p.add_argument("--num-threads", type=int, help="compute threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as exc:
        print(f"fdx: error: cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return 1
    with src:
        lines = [ln for ln in src.read().splitlines()]
    import fdx
    from tqdm import tqdm

    kw = {k: getattr(args, k) for k in ("max_model_len", "max_num_seqs", "device", "num_threads")
          if getattr(args, k) is not None}
    llm = fdx.LLM(args.model, **kw)
    numbered = [(i, ln) for i, ln in enumerate(lines) if ln.strip()]
    jobs = [parse_job(i, ln, llm) for i, ln in numbered]
    bar = tqdm(total=len(jobs), desc="requests", unit="req", disable=args.no_progress, file=sys.stderr)
    bar.update(sum(1 for j in jobs if j.error is not None or j.body is not None))
    run(llm, jobs, bar, group=max(8, llm.config.max_num_seqs))
    bar.close()
    text = "".join(json.dumps(record(llm, j), ensure_ascii=False) + "\n" for j in jobs)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        tmp = f"{args.output}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, args.output)
    failed = sum(1 for j in jobs if j.error is not None or j.status != 200)
    print(f"fdx run-batch: {len(jobs)} requests, {len(jobs) - failed} succeeded, {failed} failed -> {args.output}",
          file=sys.stderr)
    return 0
