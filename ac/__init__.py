"""Activation checkpointing, per transformer block: the policies and the wrapping (`ac.policies`), the one-batch
profile of what each block saves and computes (`ac.profile`) and the budget planner (`ac.budget`)."""
