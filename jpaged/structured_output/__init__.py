"""Structured outputs: grammars that every output token keeps to.

A request's `StructuredOutputsParams` (jpaged.sampling_params) compiles once, when the
request is added (`GrammarCompiler`, a bounded cache keyed by the constraint), into a
`Grammar`: the state of an llguidance matcher. Each sequence carries its own (samples
fork it with themselves). Every step, for each row the sampler draws for a sequence with
a grammar, `TokenMasks` fills the packed bitmask of the tokens the grammar allows next,
while the device runs the model; the sampler gives the other tokens -inf
(jpaged.model.sampler). The scheduler advances a sequence's grammar with every token it
appends, and ends the sequence once the grammar is complete.
"""
