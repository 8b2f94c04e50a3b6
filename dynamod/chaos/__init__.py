"""Runbook-driven fault injection: typed runbooks, real faults on the processes dynamod
started, load with a recorded request history, checkers over that history, a Chaos
Toolkit-shaped journal, a timeline picture and an index of runs. Sits beside rollout/ and
ops/ (it may import them and core/); nothing below imports it."""
