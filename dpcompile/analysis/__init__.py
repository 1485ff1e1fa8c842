"""Analyses over captured graphs: what the passes and the planners decide before anything is rewritten.

=================  ==================================================================
``ops``            the op catalogue: families of functions, methods and modules
``placement``      the placement of a value in a data-parallel program
``batch_rules/``   per-op batch rules by op family, and their registry
``batch_dims``     batch-dim propagation and how each input is split
``sharding_rules`` per-op sharding rules and the layouts of tensor parallelism
``sharding``       Linear sites, plan checks, the sharding analysis, ``resolve_plan``
``cost``           the communication cost model
``graph_view``     the networkx view of a graph (Linear chains and groups)
=================  ==================================================================
"""
