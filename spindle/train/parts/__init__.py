"""The parts a training task is assembled from (torchtitan's model spec: a record of parts, not a class tree).

A language-model task (`spindle.train.tasks.causal_lm.CausalLMTask` and its input kinds) holds an optional
experts part (`experts.py`: expert layouts, EP, router metrics) chosen from the family record; the objective
parts live in `spindle.train.objectives`. A part is an object the task calls at named points; no task class
combines two others."""
