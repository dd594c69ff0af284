"""The CLI verbs (validate, plan, render, deploy, diff, down, status, rollout, bench, tune, init, lab)."""
