"""The search: the partition problem, its cost terms, the ILP and the exact oracle, the outer search."""

from planner.search.search import Config, Search, SearchSpace

__all__ = ["Config", "Search", "SearchSpace"]
