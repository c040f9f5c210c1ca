"""Training objectives: the parts a task plugs in to turn model outputs into a loss (flow matching, DPO, GRPO, ...)."""
