"""Full-vocabulary logprob (``logprob``): blocked CPU, Triton and native ``log_softmax``."""
