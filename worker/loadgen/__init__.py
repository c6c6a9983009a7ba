"""The load generator (`kvhandoff load`): plays the frontend against a tier and its engines."""
