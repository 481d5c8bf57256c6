"""Cost model: compute, collectives, memory, pipeline schedule simulation and the plan simulator."""
