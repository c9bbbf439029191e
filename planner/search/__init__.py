"""The search: the partition problem, its cost terms, the ILP and the exact oracle, the outer search."""

from planner.search.configs import Config, SearchSpace
from planner.search.search import Search

__all__ = ["Config", "Search", "SearchSpace"]
