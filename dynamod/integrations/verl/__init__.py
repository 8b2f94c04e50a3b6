"""verl's rollout backend `dynamod`: a replica that attaches to a running dynamod stack.

Importing this package imports nothing from verl or Ray, so its pure parts (config,
stack view, completions) can be used and tested without them. `plugin` is what verl
loads (the `verl.plugins` entry point, or VERL_USE_EXTERNAL_MODULES): it checks the verl
version and registers the replica and the server adapter under the rollout name below.
"""

ROLLOUT_NAME = "dynamod"
