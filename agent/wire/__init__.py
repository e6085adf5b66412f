"""What the agent side and the supervisor share: the wire protocol, errors, layered
settings, the periodic tick and job secrets; and what the ranks and their node agent
share: the heartbeat datagram, the environment the agent sets, the exit notes. Every
side imports it; it imports none of them."""
