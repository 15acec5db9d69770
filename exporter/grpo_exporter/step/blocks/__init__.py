"""The metric blocks, one module per signal-chain layer (the functional module of the same name holds their
math)."""
