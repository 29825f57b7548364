"""Ray's fake multi-node node provider with two things a cloud does that it does not.

* An instance the cloud has taken back is no longer listed. The fake provider keeps a node listed until the
  autoscaler terminates it, and the autoscaler never terminates one whose raylet died: the provider tags its nodes
  with the launcher's `uninitialized` status, and the autoscaler's check for lost nodes skips every node that is
  not `up-to-date` (it shows as pending forever), so after a preemption no replacement would ever start. Here a
  node whose raylet has exited (tests/autoscaling_head.py kills it at its preemption's deadline) is taken off the
  list, as the cloud would take off the instance. (Any raylet that exits counts, where a cloud drops only the
  instances it reclaimed: in these tests only a preemption ends one.)
* Capacity can run out: after a spot preemption a zone often has no instance to give for a while. While the file
  named by the provider config's `no_capacity_file` exists, a launch waits (the autoscaler counts the node as
  pending), and it goes on once the file is removed. A cloud would fail the launch at once and the autoscaler
  would try again later; waiting is simpler and ends the same way, with the node started once there is capacity.
"""

import os
import time

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class PreemptibleFakeProvider(FakeMultiNodeProvider):
    def non_terminated_nodes(self, tag_filters):
        with self.lock:
            for node_id in [n for n in self._nodes if n != self._head_node_id]:
                node = self._nodes[node_id]["node"]
                if not any(kind == "raylet" for kind, _ in node.live_processes()):
                    self._nodes.pop(node_id)
                    node.kill_all_processes(check_alive=False, allow_graceful=False)
        return super().non_terminated_nodes(tag_filters)

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        # Called on the autoscaler's launcher thread, not its update loop: waiting here delays this launch only.
        no_capacity = self.provider_config.get("no_capacity_file")
        while no_capacity and os.path.exists(no_capacity):
            time.sleep(1)
        return super().create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
