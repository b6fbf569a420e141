"""The RL harness: GRPO on any transformers MoE causal LM, fault recipes, margins by bisection."""
