"""The load generator behind `thermocline loadgen`: open- and closed-loop load on the gateway,
latency percentiles per intent class, and sweeps that find the SLA knee (README.md beside this file)."""
