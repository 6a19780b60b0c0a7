"""The nemesis suite: writers and faults at once, then I1-I7 checked against the history."""
