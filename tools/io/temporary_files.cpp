// Temporary files removed on SIGINT and SIGTERM (see temporary_files.hpp). The handler may only
// make async-signal-safe calls: the paths sit in fixed arrays and unlink() takes them as they are.
#include <array>
#include <atomic>
#include <climits>
#include <csignal>
#include <cstring>
#include <mutex>
#include <string>
#include <signal.h>
#include <unistd.h>
#include "temporary_files.hpp"

namespace gpupool::io::detail {

namespace {

enum SlotState : int { kFree = 0, kFilling = 1, kHeld = 2 };

struct Slot {
  std::atomic<int> state{kFree};
  char path[PATH_MAX] = {};
};

std::array<Slot, 16> g_slots;
struct sigaction g_previous_interrupt {}, g_previous_terminate {};

extern "C" void remove_and_resignal(int signal) {
  remove_registered_temporaries();
  // The signal is blocked while its handler runs: raised again, it arrives once this returns,
  // under the action it had before ours.
  ::sigaction(signal, signal == SIGINT ? &g_previous_interrupt : &g_previous_terminate, nullptr);
  ::raise(signal);
}

// Ours replaces the default action or a handler, which it keeps to pass the signal on; a signal
// the process ignores stays ignored. Checked at every registration, not once: whoever set the
// action since (a test framework around each test, say) may have put theirs back.
void install_for(int signal, struct sigaction& previous) {
  struct sigaction now {};
  if (::sigaction(signal, nullptr, &now) != 0 || now.sa_handler == SIG_IGN ||
      now.sa_handler == remove_and_resignal)
    return;
  struct sigaction ours {};
  ours.sa_handler = remove_and_resignal;
  ::sigemptyset(&ours.sa_mask);
  previous = now;
  ::sigaction(signal, &ours, nullptr);
}

std::mutex g_installing;

void install_handlers() noexcept {
  try {
    std::lock_guard lock(g_installing);
    install_for(SIGINT, g_previous_interrupt);
    install_for(SIGTERM, g_previous_terminate);
  } catch (...) {  // no lock to be had: the files are still removed on every other path
  }
}

}  // namespace

int register_temporary(const std::filesystem::path& path) noexcept {
  const std::string& text = path.native();
  if (text.size() >= PATH_MAX) return -1;
  install_handlers();
  for (std::size_t i = 0; i < g_slots.size(); ++i) {
    int expected = kFree;
    if (!g_slots[i].state.compare_exchange_strong(expected, kFilling, std::memory_order_acquire))
      continue;
    std::memcpy(g_slots[i].path, text.c_str(), text.size() + 1);
    g_slots[i].state.store(kHeld, std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void forget_temporary(int slot) noexcept {
  if (slot >= 0 && static_cast<std::size_t>(slot) < g_slots.size())
    g_slots[static_cast<std::size_t>(slot)].state.store(kFree, std::memory_order_release);
}

void remove_registered_temporaries() noexcept {
  for (Slot& slot : g_slots)
    if (slot.state.load(std::memory_order_acquire) == kHeld) ::unlink(slot.path);
}

}  // namespace gpupool::io::detail
