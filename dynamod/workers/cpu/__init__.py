"""CPU rollout worker: the tiny Llama in numpy (or the mocker) behind dynamo.vllm's RL routes.

    python -m dynamod.workers.cpu --model-path DIR [--model-name NAME] [dynamo.mocker flags]
                                  [--engine numpy|mocker] [--threads N] [--cache-blocks N]
                                  [--initial-version V] [--drain-timeout S] [--start-paused]
                                  [--modeled-reset-s S (mocker, benchmarks only)]

The default engine (`numpy_engine`) generates with the model directory's Llama in numpy at
the weights the worker holds; the worker's process never imports torch (a start cost 2.8
CPU-seconds with it, 0.56 without: bench.worker_start). `--engine mocker` runs Dynamo's
mocker engine instead, and two Dynamo runtimes then share this process and its event loop:

* the *engine* runtime (file discovery in a private directory, invisible outside) serves
  Dynamo's mocker engine exactly as `python -m dynamo.mocker` builds it
  (`make_engine` + `run_input`);
* the *public* runtime (etcd discovery) registers the model and serves the worker's
  `generate` endpoint, which forwards each request to the engine. It also serves the
  RL admin routes of `dynamo.vllm` 1.6.1 on the system port (`POST /engine/<name>`),
  with the same request and response shapes.

Standing between the frontend and the engine is what makes those routes real:
`pause_generation` stops admission (new requests wait until `resume_generation`; a
worker started with `--start-paused`, as dynamod starts its shards, is paused from the
moment it registers until dynamod's rejoin resumes it),
`flush_cache` replaces the engine with a fresh one, which has no cached prefix
blocks (the mocker offers no other reset; the public instance id stays the same),
and every response carries the weight version it was admitted under, the weights'
digest and the serving instance in `engine_data` (returned by the frontend as
`nvext.engine_data` when a request asks for `"nvext": {"extra_fields": ["engine_data"]}`).
The engine's KV events are relayed to the router as the public worker's, and a flush
tells the router that all of the worker's blocks are gone.

The worker holds real weights (numpy arrays): the model directory's `model.safetensors`
at start, replaced by `update_weights_from_disk` or a hosted extension's update; their
digest is the one the trainer computes over torch tensors. The numpy engine generates
with them; the mocker's output does not depend on them.

Modules, one job each: `errors` (the worker's error, Dynamo's typed engine death),
`numpy_engine` (the default engine: the tiny model on CPU, continuous batching, prefix
cache) and `numpy_llama` (its model), `sampling` (request options, sampling, logprobs),
`prefix_cache`, `llama` (the same model in torch: the trainer's, for autograd),
`llama_config` (the config.json both read), `mocker` (the replaceable engine on a private
runtime), `kv_events` (the KV event relay to the router), `admission` (admission, pause,
weights and the RL admin routes), `routes` (registering handlers, upstream's taint route),
`extension` (hosting a vLLM worker extension class, `--worker-extension-cls`: verl's
colocated weight path), `args` (the command line and the environment), `serve` (the public
runtime, wiring it all together).
"""
