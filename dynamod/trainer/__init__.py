"""A small CPU GRPO trainer that drives real policy updates through a dynamod stack.

    python -m dynamod.trainer --frontend URL --model NAME --model-dir DIR --checkpoint-dir DIR

Modules, one job each:

  config.py       command line -> TrainerConfig
  prompts.py      the built-in prompts and which ones a step uses
  rollout.py      generation through the Dynamo frontend, pinned to the ledger's version
  history.py      the JSONL request history and its invariant (no stale response)
  grpo.py         rewards, group-normalised advantages, the policy-gradient loss (pure)
  learner.py      the Llama policy and its AdamW optimizer
  checkpoints.py  step-<N>/model.safetensors, written atomically, last K kept
  control.py      what the trainer asks the dynamod daemon (ledger, shards, push)
  loop.py         the loop tying them together, one log line per step
"""
