"""The integration guide's three boundaries as checks, for scripts/validate-gpu.sh.

`python -m dynamod.integrations.verl.validate CHECK --state-dir DIR [...]` prints one
`PASS|FAIL <check>: <detail>` line and exits 0 or 1:

* `tokens`: N requests through the frontend at the current policy (as the rollout
  server sends them, logprobs on); every completed one has as many logprobs as token
  ids; completed, aborted and failed attempts are counted apart.
* `steps --step S`: the ledger is at S, every shard reports S and is admitted, and a
  request sent after the update is served at S.
* `updates`: after every update the backend logged (`<state_dir>/verl/updates.jsonl`,
  both weight paths), every shard it found admitted acknowledged the trainer's step
  with one digest, and the commit held none; steps move forward.
* `routing --label L`: a fixed prompt set at fixed concurrency; prints useful output
  (completion tokens/s, KV hit rate = cached / prompt tokens) as one JSON line to append
  to the report, so the round-robin and kv runs can be compared side by side.

The judging functions are pure and unit-tested; `main` only gathers the data.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dynamod.integrations.verl.completions import Completion
from dynamod.integrations.verl.updates import read_updates


def judge_tokens(results: Sequence[Completion | Exception]) -> tuple[bool, str]:
    completed = [r for r in results if isinstance(r, Completion) and r.stop_reason != "aborted"]
    aborted = [r for r in results if isinstance(r, Completion) and r.stop_reason == "aborted"]
    failed = [r for r in results if isinstance(r, Exception)]
    detail = f"{len(completed)} completed, {len(aborted)} aborted, {len(failed)} failed"
    if failed:
        return False, f"{detail}; first failure: {failed[0]}"
    if not completed:
        return False, f"{detail}; nothing completed"
    missing = [r for r in completed if r.log_probs is None]
    if missing:
        return False, f"{detail}; {len(missing)} completed without logprobs"
    uneven = [r for r in completed if len(r.log_probs or []) != len(r.token_ids)]
    if uneven:
        return False, f"{detail}; {len(uneven)} with token ids and logprobs of unequal length"
    return True, detail


def judge_steps(policy: Mapping[str, Any], step: int, served: Sequence[Any]) -> tuple[bool, str]:
    shards = {s["name"]: s for s in policy.get("shards", [])}
    if policy.get("current") != step:
        return False, f"ledger at {policy.get('current')}, trainer step {step}"
    behind = {n: s.get("policy_version") for n, s in shards.items()
              if s.get("policy_version") != step or not s.get("admitted")}
    if not shards or behind:
        return False, f"shards not at step {step} and admitted: {behind or 'no shards'}"
    if not served or any(v != step for v in served):
        return False, f"post-update generation served at {sorted(set(map(str, served)))}"
    return True, f"{len(shards)} shards at step {step}; {len(served)} post-update requests ok"


def served_versions(results: Sequence[Completion | Exception],
                    units: Sequence[Mapping[str, Any]]) -> list[tuple[Any, str]]:
    """Each completed request's (version, how it is known): the engine's own report
    (`engine_data`) where it gives one ("engine"); else, for an engine that reports none
    (dynamo.vllm 1.6.1), the version the shard that served it (`worker_id`, one of its
    Dynamo instances) reported at its last update, which dynamod checked with
    get_weight_version ("shard"); None when neither is known."""
    by_instance = {instance: unit.get("policy_version") for unit in units
                   for instance in (unit.get("dynamo") or {}).get("instance_ids") or []}
    found: list[tuple[Any, str]] = []
    for r in results:
        if not isinstance(r, Completion):
            continue
        if r.extra.get("weight_version") is not None:
            found.append((r.extra["weight_version"], "engine"))
        elif r.extra.get("worker_id") in by_instance:
            found.append((by_instance[r.extra["worker_id"]], "shard"))
        else:
            found.append((None, f"unknown (worker {r.extra.get('worker_id')})"))
    return found


def judge_updates(records: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    if not records:
        return False, "no weight update was logged (<state_dir>/verl/updates.jsonl)"
    previous = None
    for record in records:
        step, shards, acks = record.get("step"), record.get("shards") or [], record.get("acks")
        where = f"update to step {step}"
        if not isinstance(step, int) or (previous is not None and step <= previous):
            return False, f"{where}: steps do not move forward (after {previous})"
        previous = step
        if not shards:
            return False, f"{where}: no admitted shard at the time"
        missing = sorted(set(shards) - set(acks or {}))
        if missing:
            why = {n: (record.get("errors") or {}).get(n, "?") for n in missing}
            return False, f"{where}: no acknowledgement from {missing}: {why}"
        digests = sorted({str(d) for d in (acks or {}).values()})
        if len(digests) != 1:
            return False, f"{where}: shards acknowledged different digests {digests}"
        if record.get("stale"):
            return False, f"{where}: publish held {record['stale']}"
        if record.get("behind"):
            return False, f"{where}: other nodes' shards not at the step {record['behind']}"
    shards = sorted({n for r in records for n in r.get("shards") or []})
    return True, (f"{len(records)} updates (steps {records[0]['step']}..{previous}): every shard "
                  f"of {shards} acknowledged each step")


async def _requests(state_dir: Path, prompts: list[list[int]], concurrency: int,
                    max_tokens: int) -> tuple[list[Completion | Exception], list[Any], float]:
    import aiohttp

    from dynamod.integrations.verl import completions
    from dynamod.integrations.verl.config import RolloutSettings
    from dynamod.integrations.verl.stack import read_stack

    view = read_stack(state_dir)
    assert view.frontend_url and view.model
    settings = RolloutSettings()
    slots = asyncio.Semaphore(concurrency)
    usages: list[Any] = []

    async def one(session: aiohttp.ClientSession, i: int, p: list[int]) -> Completion:
        async with slots:
            body = completions.build_request(
                model=view.model or "", prompt_ids=p,
                sampling_params={"logprobs": True, "temperature": 1.0},
                max_tokens=max_tokens, version=view.current_version, settings=settings,
                request_id=f"validate-{i}")
            async with session.post(f"{view.frontend_url}/v1/completions", json=body) as r:
                answer = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {str(answer)[:200]}")
            usages.append(answer.get("usage"))
            return completions.parse_response(answer, want_log_probs=True,
                                              version=view.current_version)

    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts)),
                                       return_exceptions=True)
    elapsed = time.monotonic() - started
    clean: list[Completion | Exception] = [
        r if isinstance(r, Completion | Exception) else RuntimeError(str(r)) for r in results]
    return clean, usages, elapsed


def _prompts(n: int, length: int) -> list[list[int]]:
    shared = list(range(10, 10 + length // 2))  # a shared prefix, as a GRPO group has
    return [shared + [100 + i] * (length - len(shared)) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamod.integrations.verl.validate")
    parser.add_argument("check", choices=["tokens", "steps", "updates", "routing"])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--step", type=int)
    parser.add_argument("--label", default="")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.check == "updates":
        ok, detail = judge_updates(read_updates(args.state_dir))
        print(f"{'PASS' if ok else 'FAIL'} updates: {detail}")
        return 0 if ok else 1
    prompts = _prompts(args.requests, args.prompt_len)
    results, usages, elapsed = asyncio.run(
        _requests(args.state_dir, prompts, args.concurrency, args.max_tokens))
    if args.check == "tokens":
        ok, detail = judge_tokens(results)
    elif args.check == "steps":
        from dynamod.client import Client

        if args.step is None:
            parser.error("steps needs --step")
        client = Client(args.state_dir)
        served = served_versions(results, client.status()["units"])
        ok, detail = judge_steps(client.policy_status(), args.step, [v for v, _ in served])
        how = sorted({h for _, h in served})
        detail += f" (served versions known from: {', '.join(how) or 'nothing'})"
    else:
        tokens = sum(len(r.token_ids) for r in results if isinstance(r, Completion))
        prompt = sum((u or {}).get("prompt_tokens", 0) for u in usages)
        cached = sum(((u or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                     for u in usages)
        row = {"label": args.label, "requests": len(prompts), "concurrency": args.concurrency,
               "tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
               "kv_hit_rate": round(cached / prompt, 3) if prompt else None,
               "failed": sum(isinstance(r, Exception) for r in results)}
        ok, detail = row["failed"] == 0, json.dumps(row)
    print(f"{'PASS' if ok else 'FAIL'} {args.check}{' ' + args.label if args.label else ''}: "
          f"{detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
