"""The swarm's processes: the stage miner server (a layer block behind the stage wire) and the route driver
(an `Engine` over a route of stage miners)."""
