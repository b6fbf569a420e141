"""Runs in: step metrics from planner's harness and from verl, MindSpeed-RL and NeMo RL logs, and
the fault signatures in them."""
