"""Real-size model checks without weights: the published transformer configurations, parameter and memory accounting, random-weight pipeline folders."""
