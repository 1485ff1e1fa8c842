"""Analyses over captured graphs: batch-dim propagation, shapes, the networkx view, costs."""
