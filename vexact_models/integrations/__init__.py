"""Integrations with RL frameworks. Each is an optional extra and imports its framework, so this
package imports none of them:

- `vexact_models.integrations.trl` (``pip install vexact-models[trl]``): `VexactGRPOTrainer`,
  TRL's ``GRPOTrainer`` generating with `vexact_models.LLM` and computing training logprobs with
  ``token_logprobs``, so that TRL's own importance-sampling ratio reads exactly 1 and its logprob
  difference exactly 0. Example: ``examples/trl_grpo.py``. `VexactRLOOTrainer` and
  `VexactDistillationTrainer` do the same for TRL's ``RLOOTrainer`` and ``DistillationTrainer``.
- `vexact_models.integrations.verl` (``pip install vexact-models[verl]``): a verl rollout backend
  and the actor's logprob hook, so that verl's ``rollout_probs_diff_max`` is 0 (``docs/verl.md``).
"""
