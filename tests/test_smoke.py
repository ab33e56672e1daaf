from lab import independent_digest


def test_publish_and_refit_chain(flow_lab):
    lab = flow_lab
    r0 = lab.publish("initial")
    r1 = lab.publish("delta")
    r2 = lab.publish("delta")
    assert (r0.version, r1.version, r2.version) == ("r0", "r1", "r2")
    state, result = lab.refit()
    assert state.name == "Ready", result.error
    assert result.version == "r2"
    assert result.target_digest == independent_digest(lab.expected("r2"))[1]
    lab.assert_checkpoint(result.checkpoint_path, "r2")
