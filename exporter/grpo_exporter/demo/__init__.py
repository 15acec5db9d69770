"""A real, tiny GRPO run on the CPU with injectable faults: how a user meets grpo-exporter.

Everything here uses only the public API (``GRPOMonitor``), as a user's training loop would. Nothing in the
package imports this module.
"""
