"""Search for the cheapest proxy within a budget whose predicted fidelity clears a threshold."""
