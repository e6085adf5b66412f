"""What the agent side and the supervisor share: the wire protocol, errors, layered
settings, the periodic tick and job secrets. Both import it; it imports neither."""
