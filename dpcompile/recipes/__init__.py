"""Recipes: the typed, picklable description of how to compile a model.

A recipe holds the options ``transform`` validated once (devices, plan, frontend, ...) and
knows the whole story of its kind of parallelism, top to bottom: capture → pipeline →
module, and how to build the program for a call that departs from the first one.

* :class:`~dpcompile.recipes.data_parallel.DataParallelRecipe` (devices in one process);
* :class:`~dpcompile.recipes.tensor_parallel.TensorParallelRecipe` (shards in one process);
* :class:`~dpcompile.recipes.spmd.SpmdRecipe` (one process per device over a DeviceMesh);
* :class:`~dpcompile.recipes.pipeline.PipelineRecipe` (stages by depth, micro-batches, in one process).
"""

from dpcompile.recipes.base import Recipe
from dpcompile.recipes.data_parallel import DataParallelRecipe
from dpcompile.recipes.pipeline import PipelineRecipe
from dpcompile.recipes.spmd import SpmdRecipe
from dpcompile.recipes.tensor_parallel import TensorParallelRecipe

__all__ = ["DataParallelRecipe", "PipelineRecipe", "Recipe", "SpmdRecipe", "TensorParallelRecipe"]
